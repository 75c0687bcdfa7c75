"""The time of one pass of a zero-bubble pipeline schedule, played out action by action.

The zero-bubble schedules (``--pp-schedule zero-bubble``, torch's ScheduleInterleavedZeroBubble,
and ``zbv``, ScheduleZBVZeroBubble) split each backward into an input-gradient pass (I), sent
on to the previous stage at once, and a weight-gradient pass (W) that waits to fill idle
slots. Their bubble depends on how those three kinds of work line up, so no closed formula
of P, M and V gives it: the planner takes each rank's list of actions from torch's own
schedule (the order a run executes) and plays it out, each action starting when its rank is
free and its input has arrived.
"""

from __future__ import annotations

from dataclasses import dataclass

Action = tuple[str, int, int]
"""(kind ``"F"``, ``"I"`` or ``"W"``, stage index, micro-batch index)."""


@dataclass(frozen=True)
class ActionTimes:
    """Seconds of one stage chunk's forward, input-gradient and weight-gradient pass of one
    micro-batch, and of one transfer between ranks (an activation or its gradient)."""

    forward: float
    input_grad: float
    weight_grad: float
    transfer: float


def stage_rank(stage: int, pp: int, schedule: str) -> int:
    """The rank that runs ``stage``: zbv's V goes down the ranks and back up (stage 2P-1 on
    rank 0), the interleaved schedule loops (stage s on rank s mod P)."""
    if schedule == "zbv":
        return stage if stage < pp else 2 * pp - 1 - stage
    return stage % pp


def zero_bubble_orders(schedule: str, pp: int, microbatches: int, stages_per_rank: int) -> dict[int, list[Action]]:
    """Each rank's actions in the order torch's schedule runs them (its idle steps dropped:
    a rank waits for its input instead)."""
    # torch builds these orders in its schedules' constructors, which need live stages; the
    # methods below read only the sizes set here, so the planner runs torch's own ordering.
    from torch.distributed.pipelining.schedules import ScheduleInterleavedZeroBubble, ScheduleZBVZeroBubble

    if schedule == "zbv":
        zbv = ScheduleZBVZeroBubble.__new__(ScheduleZBVZeroBubble)
        zbv.pp_group_size, zbv.num_stages, zbv._n_microbatches = pp, 2 * pp, microbatches
        orders = {rank: zbv._calculate_single_rank_operations(rank) for rank in range(pp)}
    elif schedule == "zero-bubble":
        looped = ScheduleInterleavedZeroBubble.__new__(ScheduleInterleavedZeroBubble)
        looped.pp_group_size, looped.n_local_stages, looped._n_microbatches = pp, stages_per_rank, microbatches
        looped.number_of_rounds = max(1, microbatches // pp)
        looped.microbatches_per_round = microbatches // looped.number_of_rounds
        looped.pipeline_order = {rank: looped._calculate_single_rank_operations(rank) for rank in range(pp)}
        orders = looped._add_bubbles_to_actions(stages_per_rank * pp)
    else:
        raise ValueError(f"{schedule} is not a zero-bubble schedule")
    return {rank: [(action.computation_type.value, action.stage_index, action.microbatch_index)
                   for action in actions if action is not None] for rank, actions in orders.items()}


def pass_seconds(orders: dict[int, list[Action]], schedule: str, times: ActionTimes) -> float:
    """The time from the first forward to the last action of one pass: every rank runs its
    actions in order; a forward waits for the previous stage's forward of the micro-batch, an
    input-gradient pass for its own forward and the next stage's input gradient (the last
    stage starts backward from its loss), a weight-gradient pass for its input-gradient pass;
    an input from another rank arrives one transfer later."""
    pp = len(orders)
    n_stages = 1 + max(stage for actions in orders.values() for _, stage, _ in actions)
    duration = {"F": times.forward, "I": times.input_grad, "W": times.weight_grad}
    done: dict[Action, float] = {}
    free = dict.fromkeys(orders, 0.0)
    position = dict.fromkeys(orders, 0)

    def ready(kind: str, stage: int, microbatch: int, rank: int) -> float | None:
        needs = []
        if kind == "F" and stage > 0:
            needs.append(("F", stage - 1))
        if kind == "I":
            needs.append(("F", stage))
            if stage < n_stages - 1:
                needs.append(("I", stage + 1))
        if kind == "W":
            needs.append(("I", stage))
        start = 0.0
        for need_kind, need_stage in needs:
            finished = done.get((need_kind, need_stage, microbatch))
            if finished is None:
                return None
            hop = times.transfer if stage_rank(need_stage, pp, schedule) != rank else 0.0
            start = max(start, finished + hop)
        return start

    remaining = sum(len(actions) for actions in orders.values())
    while remaining:
        progressed = False
        for rank, actions in orders.items():
            while position[rank] < len(actions):
                action = actions[position[rank]]
                arrived = ready(*action, rank)
                if arrived is None:
                    break
                free[rank] = max(free[rank], arrived) + duration[action[0]]
                done[action] = free[rank]
                position[rank] += 1
                remaining -= 1
                progressed = True
        if not progressed:
            raise RuntimeError(f"the {schedule} schedule's actions wait on each other: {orders}")
    return max(free.values())
