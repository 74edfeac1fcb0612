"""Verification: prove that the target run matches the baseline, tensor by tensor and metric by metric.

- ``predicate``    the threshold language (``rel <= 0.0085 and norm_ratio <= 0.015``), parsed, never eval'd
- ``tensor_diff``  rel / max_abs / mean_abs / norm_ratio of one tensor pair
- ``dumps``        compare two dump trees leaf by leaf under ordered (regex, predicate) rules; dead rules fail
- ``inventory``    which tensors exist: names, shapes, dtypes on both sides and in every rollout
- ``metrics``      compare the final-attempt metrics of two event logs within rtol/atol
- ``reconfigure``  assert the exact sequence of cell reconfigurations
- ``report``       the verdict (checks) and report.json / report.md / curves
"""

from ftexp.verify.dumps import DumpComparison, DumpRecord, compare_dumps, leaf_set
from ftexp.verify.metrics import MetricComparison, MetricRow, compare_metrics
from ftexp.verify.predicate import Predicate, PredicateError, parse_predicate
from ftexp.verify.reconfigure import ReconfigureInfo, check_reconfigure_events, reconfigure_infos
from ftexp.verify.report import CheckResult, Verdict, plot_curves, write_report
from ftexp.verify.tensor_diff import TensorDiff, tensor_diff

__all__ = [
    "CheckResult", "DumpComparison", "DumpRecord", "MetricComparison", "MetricRow", "Predicate",
    "PredicateError", "ReconfigureInfo", "TensorDiff", "Verdict", "check_reconfigure_events",
    "compare_dumps", "compare_metrics", "leaf_set", "parse_predicate", "plot_curves",
    "reconfigure_infos", "tensor_diff", "write_report",
]
