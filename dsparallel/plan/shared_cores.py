"""A pipeline step on hosts whose ranks outnumber their cores.

The schedule's C++ simulation gives each rank a processor of its own. When
a host has fewer cores than ranks (a CPU host running more processes than
cores), the ranks that can run share the cores fairly, as the kernel's
scheduler shares them, and a rank that waits for its peer (dsparallel's
waits sleep on a futex) lends its core to the others. But when fewer ranks
can run than there are cores (a pipeline filling or draining), cores stand
idle. This module follows that: each rank runs its actions in the
schedule's order; an action runs once what it needs has run (a forward the
previous stage's forward, a backward the next stage's); the ranks that can
run on a host progress at min(1, cores / their number) each.

A pipeline rank stands for every rank that holds the same stages (the data,
context and tensor-parallel ranks beside it): they run the same actions at
the same pace, so they are simulated once and counted as many times.
"""

from __future__ import annotations

from .layout import Layout


def _needs(kind: str, stage: int, mb: int, last: int) -> list[tuple[str, int, int]]:
    if kind == "F":
        return [("F", stage - 1, mb)] if stage > 0 else []
    if kind in ("B", "I"):
        after = [("F", stage, mb)]
        return after + ([("BI", stage + 1, mb)] if stage < last else [])
    if kind == "W":
        return [("BI", stage, mb)]
    return []


def _host_loads(lay: Layout, devices_per_host: int) -> list[list[int]]:
    """Per host, how many of its ranks each pipeline rank has there (the
    mesh is pp-major: a pipeline rank's tp x cp x dp ranks are adjacent)."""
    width = lay.world // lay.pp
    hosts = max(1, lay.world // devices_per_host)
    loads = [[0] * lay.pp for _ in range(hosts)]
    for g in range(lay.world):
        loads[g // devices_per_host][g // width] += 1
    return loads


def step_time(
    schedule, lay: Layout, costs, tail: float, cores: int, devices_per_host: int
) -> float:
    """Seconds until every rank has run its actions and then ``tail`` more
    seconds of its own work (the gradients' reduction, the optimizer), with
    ``cores`` cores per host. ``costs[stage]`` = (forward, input gradient,
    weight gradient) seconds per micro-batch; a whole backward is the last
    two. ``schedule`` is None without a pipeline (one stage, micro-batches
    one after another)."""
    if schedule is None:
        programs = [[a for m in range(lay.micro_batches) for a in (("F", 0, m), ("B", 0, m))]]
        last = 0
    else:
        programs = [
            [(a.kind, a.stage, a.microbatch) for a in actions if a.kind in ("F", "B", "I", "W")]
            for actions in schedule.ranks
        ]
        last = schedule.num_stages - 1
    for program in programs:
        program.append(("tail", -1, -1))

    def cost(action) -> float:
        kind, stage, _ = action
        if kind == "tail":
            return tail
        f, i, w = costs[stage]
        return {"F": f, "I": i, "W": w, "B": i + w}[kind]

    loads = _host_loads(lay, devices_per_host)
    pos = [0] * len(programs)
    left = [cost(p[0]) for p in programs]
    done: set[tuple[str, int, int]] = set()
    now = 0.0
    while True:
        running = [
            r
            for r, program in enumerate(programs)
            if pos[r] < len(program)
            and all(need in done for need in _needs(*program[pos[r]], last))
        ]
        if not running:
            if all(pos[r] == len(p) for r, p in enumerate(programs)):
                return now
            # Validated schedules never get here.
            raise RuntimeError("plan: the schedule's simulation is stuck")
        # Each host shares its cores among its ranks that can run; a
        # pipeline rank spread over hosts goes at its slowest host's pace.
        busy = [sum(host[q] for q in running) for host in loads]
        rate = {
            r: min([1.0] + [cores / n for host, n in zip(loads, busy) if host[r]]) for r in running
        }
        dt = min(left[r] / rate[r] for r in running)
        now += dt
        for r in running:
            left[r] -= dt * rate[r]
            if left[r] <= 1e-12:
                kind, stage, mb = programs[r][pos[r]]
                done.add((kind, stage, mb))
                if kind in ("B", "I"):
                    done.add(("BI", stage, mb))
                pos[r] += 1
                if pos[r] < len(programs[r]):
                    left[r] = cost(programs[r][pos[r]])
