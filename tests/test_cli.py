"""Bad input gets one clear line on stderr and exit code 2, and nothing is launched.

Each command line runs as ``python -m ftexp`` would, in a fork of a process that imported the CLI
once (``ftexp_runner.run_ftexp``).
"""

import pytest

from ftexp_runner import run_ftexp


@pytest.mark.parametrize("overrides, message", [
    (["mode=dp3"], "unknown mode 'dp3'"),
    (["scenario=no_such"], "unknown scenario 'no_such'"),
    (["mode=dp2", "trainer.lrr=1"], "trainer.lrr"),
    (["+foo=1"], "unknown config key(s): foo"),
    (["threshold.dumps=[['.*','rel <= ']]"], "rel <="),
    (["threshold.dumps=[['.*','__import__(\"os\")']]"], "predicate"),
    (["threshold.dumps=[['(','rel <= 1']]"], "bad regex"),
    (["mode=dp2_cp2_tp2_ep2", "trainer=torch"], "engine=torch cannot run it"),
    (["mode=dp2_cp2_tp2_ep2", "trainer.enable_witness=true"], "megatron engine has no witness parameters"),
    (["mode=dp2_cp2_tp2_ep2", "mode.tp=3"], "tp=3 must divide"),
    (["mode=dp2_cp2_tp2_ep2", "mode.ep=3"], "ep=3 must divide"),
    (["mode=dp2_cp2_tp2_ep2", "mode.sequence_parallel=false"], "needs sequence_parallel=true"),
    (["mode=dp2", "trainer.engine=megatron", "mode.model_preset=huge"], "unknown model_preset 'huge'"),
    (["mode=dp2_cp2_real_rollout", "trainer.rollout.engine_temperature=0"], "engine_temperature must be > 0"),
    (["mode=dp2_cp2_real_rollout", "mode.model_preset=tiny_moe_5layer", "mode.rollout_inject_min_match_ratio=1.5"],
     "rollout_inject_min_match_ratio must be in [0, 1)"),
    (["mode=colocate_dp2_cp2_rollout_ft"], "rollout engines colocated with the trainer (offloading between them is not "
     "built yet)"),
    (["mode=6node_dp4_cp2_tp2_pp2_ep2_etp2"], "needs 6 nodes, 4 train + 2 rollout (launcher=local is one machine: use "
     "launcher=slurm)"),
    (["mode=dp2", "launcher.nodes=2"], "launcher.nodes=2 needs launcher=slurm"),
    (["mode=dp2", "scenario=node_failure"], "needs launcher=slurm launcher.nodes>=2"),
    (["stage=compare"], "stage=compare needs run_dir"),
    (["stage=bogus"], "stage"),
    (["seed=abc"], "seed"),
    (["phase=phase_z", "scenario=with_failure"], "unknown phase"),
    (["trainer.witness_buffer_size=100"], "witness_buffer_size=100 is smaller"),
    (["trainer.audit=false", "trainer.enable_witness=true"], "needs trainer.audit=true"),
    (["trainer.spare_cells=-1"], "trainer.spare_cells=-1: the number of warm spare cells must be >= 0"),
    (["trainer.rollouts_per_call=0"], "trainer.rollouts_per_call=0: a train call trains at least one rollout"),
    (["trainer.spare_cells=1", "launcher=slurm", "launcher.nodes=2"], "trainer.spare_cells=1 needs a one-node job"),
    (["trainer.checksum=md5"], "trainer.checksum"),
    (["scenario=realistic", "task.warmup.cache_dir=/etc/passwd/warmup"], "task.warmup.cache_dir=/etc/passwd/warmup: "
     "/etc/passwd is not a directory"),
    (["scenario=with_failure", "scenario.phases.1.target_actions=[{at_rollout:1,action:boom}]"], "Invalid value 'boom'"),
    (["scenario=with_failure", "scenario.phases.1.target_actions=[{at_rollout:1,action:stop_cell_at_end,colour:red}]"],
     "scenario.phases.1.target_actions"),
])
def test_bad_input_exits_2_with_one_line(tmp_path, overrides, message):
    result = run_ftexp(*overrides, f"hydra.run.dir={tmp_path}/run", cwd=tmp_path)
    assert result.returncode == 2, result.stderr
    lines = [ln for ln in result.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("ftexp: error: ")
    assert message in lines[0]
    assert not (tmp_path / "run" / "report.md").exists()


def test_compare_on_missing_run_dir_exits_2(tmp_path):
    result = run_ftexp("stage=compare", f"run_dir={tmp_path}/nope", cwd=tmp_path, timeout=120)
    assert result.returncode == 2
    assert "does not exist" in result.stderr


def test_seed_modes_on_recorded_rollouts_are_accepted(tmp_path):
    """The seed's recorded-rollout modes compose and pass the launch checks (stage=prepare stops there)."""
    for mode in ["dp2_cp2_tp2_ep2", "dp2_cp2_pp2", "dp4_cp2"]:
        result = run_ftexp(f"mode={mode}", "stage=prepare", f"hydra.run.dir={tmp_path}/{mode}", cwd=tmp_path, timeout=120)
        assert result.returncode == 0, (mode, result.stderr)
        assert (tmp_path / mode / "rollout_data" / "0.pt").is_file()


def test_timeout_hierarchy_is_enforced(tmp_path):
    """A cross-cell timeout longer than heartbeat detection would misdiagnose a blocked peer as dead."""
    result = run_ftexp("mode=dp4", "scenario=ft_random", "trainer.cross_cell_timeout_s=60",
                       f"hydra.run.dir={tmp_path}/run", cwd=tmp_path, timeout=120)
    assert result.returncode == 2
    assert "must be < heartbeat detection" in result.stderr
