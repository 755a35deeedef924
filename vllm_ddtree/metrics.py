"""The online budget in ``/metrics``: Prometheus gauges beside vLLM's spec-decode
counters (patch ``core_ddtree-online-budget``).

The engine core's scheduler puts :meth:`vllm_ddtree.online_budget.OnlineBudget.metrics`
(a small dict, rebuilt when the budget table changes and every
``METRICS_REFRESH_STEPS`` steps) into vLLM's ``SchedulerStats.ddtree_budget`` of the
steps that rebuilt it (:meth:`~vllm_ddtree.online_budget.OnlineBudget.metrics_update`;
None in the others, whose gauges keep their values); the
front end's ``PrometheusStatLogger`` hands it to :class:`DDTreeBudgetProm`, which
sets, per engine, sampling class (``sampling="greedy"``: steps whose requests are all
greedy, ``"sampled"``: steps with a sampled request; each class has its own
controller) and batch-size bucket (``bucket="4-7"``: batch sizes 4 to 7):

``vllm:ddtree_budget``
    the tree budget the controller chose (draft nodes per request; 0: no drafting).
``vllm:ddtree_expected_tokens_per_step``
    tokens per request per step it expects at that budget (accepted + 1).
``vllm:ddtree_accepted_tokens_per_step``
    with a ``budget`` label: the accepted draft tokens per request per step measured
    at that budget (decayed over the last ~64 steps of the bucket; budgets not
    measured yet are absent).
"""

from __future__ import annotations

from typing import Any


class DDTreeBudgetProm:
    """The gauges (module docstring), built like vLLM's own metric families."""

    def __init__(self, gauge_cls: Any, labelnames: list[str],
                 per_engine_labelvalues: dict[int, list[object]]) -> None:
        self.per_engine_labelvalues = per_engine_labelvalues
        self.budget = gauge_cls(
            name="vllm:ddtree_budget",
            documentation="DDTree tree budget chosen by the online controller, per "
                          "batch-size bucket (draft nodes per request; 0: no drafting).",
            multiprocess_mode="mostrecent", labelnames=labelnames + ["sampling", "bucket"])
        self.expected = gauge_cls(
            name="vllm:ddtree_expected_tokens_per_step",
            documentation="Tokens per request per step the DDTree controller expects at "
                          "its chosen budget, per batch-size bucket.",
            multiprocess_mode="mostrecent", labelnames=labelnames + ["sampling", "bucket"])
        self.accepted = gauge_cls(
            name="vllm:ddtree_accepted_tokens_per_step",
            documentation="Accepted draft tokens per request per step measured at each "
                          "DDTree budget, per batch-size bucket (recent steps).",
            multiprocess_mode="mostrecent",
            labelnames=labelnames + ["sampling", "bucket", "budget"])

    def observe(self, metrics: dict[str, Any], engine_idx: int = 0) -> None:
        """``metrics``: :meth:`OnlineBudget.metrics` (each class's
        :meth:`BudgetController.summary`)."""
        labels = [str(v) for v in self.per_engine_labelvalues[engine_idx]]
        for sampling, m in metrics.get("sampling", {}).items():
            for bucket, budget in m.get("budget", {}).items():
                self.budget.labels(*labels, sampling, bucket).set(budget)
            for bucket, tau in m.get("expected_tokens_per_step", {}).items():
                self.expected.labels(*labels, sampling, bucket).set(tau)
            for bucket, per_budget in m.get("accepted_measured", {}).items():
                for budget, accepted in per_budget.items():
                    self.accepted.labels(*labels, sampling, bucket, str(budget)).set(accepted)
