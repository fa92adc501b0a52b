"""The decode engine's scheduler half of `--decode-yield slack|pace`: how long its next step
may pause for the prefill engine sharing its cores.

The budget comes from the running requests' TPOT objectives (each request carries its own in
``kv_transfer_params``, the connector's TPOT_KEY), what they have made so far, and the
engine's measured time per plain decode step (coreshare.StepPace); coreshare.pause_budget_s
(slack) and pace_budget_s (pace) turn those into seconds. No pause while the prefill workers
have no prompt in hand (those steps are the ones that time the pace), while a prompt starts
in the step, or while a request without an objective runs. The worker half spends the
budget (coreshare.StepYield.pause).
"""

from __future__ import annotations

import os
import time
from typing import TYPE_CHECKING

from kvtransfer.coreshare import ENV_FILE, SLACK, StepPace, StepYield, budget_mode_from_env, pace_budget_s, pause_budget_s

if TYPE_CHECKING:
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.request import Request


class StepBudget:
    def __init__(self, mode: str, prefill: StepYield) -> None:
        self.mode = mode
        self.pace = StepPace()
        self._prefill = prefill  # only its prefill_state(): the prompts in hand
        # The requests with a TPOT objective: id -> [request, objective s, when their first
        # token was seen].
        self._objectives: dict[str, list] = {}

    @classmethod
    def from_env(cls) -> StepBudget | None:
        """The budget of a decode engine in slack or pace mode (coreshare.budget_mode_from_env); None otherwise."""
        mode = budget_mode_from_env()
        return cls(mode, StepYield(os.environ[ENV_FILE], None)) if mode else None

    def add(self, request: Request, tpot_objective_s: float) -> None:
        self._objectives[request.request_id] = [request, tpot_objective_s, None]

    def forget(self, request_id: str) -> None:
        self._objectives.pop(request_id, None)

    def budget_s(self, scheduler_output: SchedulerOutput) -> float:
        """How long the step just scheduled may pause; times the pace on plain steps."""
        now = time.monotonic()
        scheduled = scheduler_output.num_scheduled_tokens
        in_hand, urgent_at, _ = self._prefill.prefill_state()
        budget = self._budget_now(now, scheduler_output, in_hand)
        # A step that only decodes (one token per request) and will not pause (no budget, no
        # urgent prompt) times the pace.
        self.pace.observe(now, plain=bool(scheduled) and budget == 0.0
                          and not scheduler_output.scheduled_new_reqs
                          and all(n == 1 for n in scheduled.values())
                          and not (in_hand > 0 and urgent_at <= now))
        return budget

    def _budget_now(self, now: float, scheduler_output: SchedulerOutput, in_hand: int) -> float:
        if scheduler_output.scheduled_new_reqs:
            return 0.0  # a prompt starts in this step: a pause would add to its TTFT
        running = []
        for request_id in scheduler_output.num_scheduled_tokens:
            entry = self._objectives.get(request_id)
            if entry is None:
                return 0.0  # no TPOT objective: nothing says what a pause would cost it
            request, objective_s, first_s = entry
            made = request.num_output_tokens
            if made >= 1 and first_s is None:
                entry[2] = first_s = now  # made by the step before this one
            running.append((made, objective_s, first_s, getattr(request, "max_tokens", None)))
        if not running or in_hand <= 0:
            return 0.0  # first tokens are recorded above all the same
        if self.mode == SLACK:
            return pause_budget_s(now, running, self.pace.step_s)
        return pace_budget_s(running, self.pace.step_s)
