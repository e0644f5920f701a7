"""Which planned points are timed together, in which order, and how a job is told which group it measures.

interleave=shape (the default) puts the points of a sweep that share everything but their strategy,
linear kernel and compile mode (harness.config.Point.group_key: model, dtype, device, batch, ctx,
timing, threads, page size, repeat) into one group, measured in one process with their steps
interleaved (harness.measure.group). interleave=none makes every point a group of its own. A point
that cannot fit in memory is not measured and stays alone (its row is a skipped one).
repeats=N measures every group N times; the groups' order is then shuffled (seeded by the sweep's
seed), so no group always runs first, or always after the same other one.

A group is the unit of work: one Hydra job each (harness.run.launch), in this process or a launcher's.
The job is told its group by one override, `+group=<spec>` (`GroupSpec.override`): the members'
overrides, their grouping and their keys, which a job in another process plans again
(harness.run.plan.plan_group) and checks against the keys; nothing travels through results_dir.
"""
from __future__ import annotations

import base64
import dataclasses
import hashlib
import json
import random
from dataclasses import dataclass

GROUP_KEY = "group"  # the job's override that names its group: +group=<GroupSpec.encode()>
SPEC_PREFIX = "g"  # a spec never reads as a number or a boolean to Hydra's override parser


@dataclass
class PlannedGroup:
    """Points measured together: one process, one model per linear kernel, steps interleaved."""

    group_id: str  # names the group in its rows: the members' shared key and the repeat
    members: list  # the members' harness.run.plan.PlannedPoint, in the sweep's order

    @property
    def points(self) -> tuple:
        return tuple(member.point for member in self.members)


@dataclass(frozen=True)
class GroupSpec:
    """What a job needs to find or plan again its group: the override that identifies its work."""

    group_id: str  # PlannedGroup.group_id
    members: tuple  # (point key, the member's overrides as the plan composed them) per member, in order
    mode: str  # interleave of the members' points: shape (timed together) or none (alone)
    repeat: int  # which repeat of the group this is
    first: int = 0  # points of the sweep handled before this group: where its progress lines count from
    again: tuple | None = None  # a second measurement (harness.run.windows): keys whose rows it is for

    @classmethod
    def of(cls, group: PlannedGroup, first: int = 0, again: tuple | None = None,
           timed: list | None = None) -> "GroupSpec":
        timed = group.members if timed is None else timed
        point = timed[0].point
        members = tuple((member.point.key, tuple(member.overrides)) for member in timed)
        return cls(group.group_id, members, point.interleave, point.repeat, first, again)

    def encode(self) -> str:
        """URL-safe base64 of JSON: letters, digits, '-' and '_', which Hydra's override parser reads as
        one plain string (no quoting, no interpolation)."""
        data = json.dumps(dataclasses.asdict(self), separators=(",", ":")).encode()
        return SPEC_PREFIX + base64.urlsafe_b64encode(data).decode().rstrip("=")

    @classmethod
    def decode(cls, text: str) -> "GroupSpec":
        body = str(text)[len(SPEC_PREFIX):]
        data = json.loads(base64.urlsafe_b64decode(body + "=" * (-len(body) % 4)))
        again = tuple(data["again"]) if data["again"] is not None else None
        members = tuple((key, tuple(overrides)) for key, overrides in data["members"])
        return cls(data["group_id"], members, data["mode"], int(data["repeat"]), int(data["first"]), again)

    def override(self) -> str:
        return f"+{GROUP_KEY}={self.encode()}"


def as_member(planned, mode: str, repeat: int):
    """A planned point as a member of a group: interleave and repeat set (both are in its key)."""
    return dataclasses.replace(planned, point=dataclasses.replace(planned.point, interleave=mode, repeat=repeat))


def form_groups(planned: list, interleave: str, repeats: int, seed: int) -> list[PlannedGroup]:
    """The groups to measure, in measuring order. Members of a group of two or more carry
    interleave=shape in their point (and so in their key); every repeat after the first carries its
    index. A point that cannot fit (does_not_fit) stays alone: its row is a skipped one."""
    by_shape: dict[str, list] = {}
    for one in planned:
        # a serving run is a process of its own: its iterations are not steps to interleave with others'
        alone = interleave == "none" or one.does_not_fit is not None or one.point.serving is not None
        by_shape.setdefault(one.point.key if alone else one.point.group_key(), []).append(one)
    groups = []
    for repeat in range(repeats):
        for members in by_shape.values():
            mode = "shape" if len(members) > 1 else "none"
            copies = [as_member(member, mode, repeat) for member in members]
            groups.append(PlannedGroup(group_id(copies), copies))
    if repeats > 1:
        random.Random(seed).shuffle(groups)
    return groups


def group_id(members: list) -> str:
    keys = ",".join(sorted(member.point.key for member in members))
    return hashlib.sha256(keys.encode()).hexdigest()[:12]
