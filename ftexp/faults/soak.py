"""The harness side of a chaos soak: inject random faults into the target job while it trains.

The target driver writes its control server's address (``control.json`` in its side dir) once the
cells are up. While the pipeline waits for the job, ``SoakInjection.poll`` starts the seeded
:class:`RandomInjector` against that server as soon as the file appears; ``stop`` joins it and
records every accepted injection (``injections.json``) for the verdict. A crash probability of 0
injects nothing at all (the injector's own floor would still fault a long run now and then).
"""

from __future__ import annotations

import json
import logging

from ftexp.faults.injector import RandomInjector
from ftexp.rundir import SideDir

log = logging.getLogger("ftexp")


class SoakInjection:
    def __init__(self, soak_cfg, seed: int, side_dir: SideDir):
        """``soak_cfg``: the scenario's soak settings (``ftexp.config.SoakConfig``)."""
        self.cfg, self.seed, self.side_dir = soak_cfg, seed, side_dir
        self.injector: RandomInjector | None = None
        self.stopped = False

    def poll(self) -> None:
        control = self.side_dir.control_file
        if self.injector is not None:
            if not control.is_file():  # the driver is shutting its server down
                self._stop_injector()
            return
        if not control.is_file() or self.cfg.crash_probability == 0:  # 0: a run without faults (a baseline soak)
            return
        base_url = json.loads(control.read_text())["base_url"]
        self.injector = RandomInjector(base_url, seed=self.seed, crash_probability=self.cfg.crash_probability,
                                       time_unit_s=self.cfg.time_unit_s, poll_interval=self.cfg.poll_interval_s,
                                       modes=list(self.cfg.modes), first_mode=self.cfg.first_mode,
                                       first_after_s=self.cfg.first_after_s)
        self.injector.start()
        log.info("soak: injecting faults into %s (mean interval %.1f s)", base_url, self.injector.mean_interval_s)

    def _stop_injector(self) -> None:
        if self.injector is not None and not self.stopped:
            self.injector.stop_and_join()
            self.stopped = True

    def stop(self) -> None:
        self._stop_injector()
        injections = [{"timestamp": i.timestamp.isoformat(), "cell": i.cell, "mode": i.mode.value}
                      for i in (self.injector.injections if self.injector is not None else [])]
        self.side_dir.injections.write_text(json.dumps(injections, indent=2))
