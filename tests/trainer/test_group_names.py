"""Weight-update group names: a new group whenever the sender changes, also back to an earlier sender."""

from ftexp.trainer.rollout_engines import GroupNames


def test_a_sender_that_pushes_again_after_another_forms_a_new_group():
    names = GroupNames("target")
    first = names.name(0, 1, 4)
    assert names.name(0, 1, 4) == first                       # same sender: the same group, no re-forming
    other = names.name(1, 1, 4)                               # cell 0 died: cell 1 sends
    healed = names.name(0, 2, 4)                              # cell 0 healed (a new incarnation) and sends
    again = names.name(1, 1, 4)                               # cell 0 died again: cell 1, as before, sends
    assert len({first, other, healed, again}) == 4            # the engines dropped cell 1's first group
    assert names.name(1, 1, 3) != again                       # one engine left out: another group too
