"""What torch's CPU allocator did in a profiled run: its allocations and frees, from the profiler's memory events."""

from __future__ import annotations

from typing import Any

import torch


def allocations(profiler: Any) -> list[int]:
    """The bytes of each CPU allocation (positive) and free (negative) that ``profiler`` (a
    ``torch.profiler.profile(profile_memory=True)``) recorded, in time order: on CPU what the CUDA caching allocator's
    statistics are on a GPU."""
    events = [
        event
        for event in profiler.profiler.kineto_results.events()
        if event.name() == "[memory]" and event.device_type() == torch.autograd.DeviceType.CPU
    ]
    return [event.nbytes() for event in sorted(events, key=lambda event: event.start_ns())]
