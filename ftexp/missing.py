"""``MISSING``: the default of a config field that the composed config must set.

OmegaConf, which composes the configs from ``conf/``, reads the string ``"???"`` in a structured
config as a missing value: composing fails with the field's name unless a config file or an
override sets it. The marker is written out here rather than imported from omegaconf, so that the
processes that only receive a config (training jobs, ranks, engines) never import omegaconf.
"""

MISSING = "???"
