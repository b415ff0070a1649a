"""A variant: one concrete kernel, its source text and its launch configuration. A node of the search graph.

Its identity is the hash of both, so two move sequences that produce the same text and configuration (a cache
modifier then a block size, or the block size first) meet in one node: a transposition, evaluated once.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from typing import Any

from .spec import KernelSpec


@dataclass(frozen=True)
class Variant:
    source: str
    launch: dict[str, Any] = field(hash=False, compare=False)  # spec.Launch as a dict; in the id, not compared
    id: str = ""

    @staticmethod
    def make(source: str, launch: dict[str, Any]) -> Variant:
        key = source + "\n" + json.dumps(launch, sort_keys=True)
        return Variant(source, launch, hashlib.sha256(key.encode()).hexdigest()[:12])

    @staticmethod
    def baseline(spec: KernelSpec) -> Variant:
        return Variant.make(spec.source_text(), spec.launch.model_dump())

    def with_launch(self, **changes) -> Variant:
        return Variant.make(self.source, {**self.launch, **changes})

    def with_constexprs(self, **changes) -> Variant:
        return self.with_launch(constexprs={**self.launch["constexprs"], **changes})

    def with_source(self, source: str) -> Variant:
        return Variant.make(source, self.launch)

    def knobs(self) -> dict[str, Any]:
        """The launch configuration flattened for tables: constexprs, num_warps, num_stages (CUDA uses neither of
        the last two; its block size is a constexpr)."""
        out = {k: v for k, v in self.launch["constexprs"].items()}
        out["num_warps"] = self.launch["num_warps"]
        out["num_stages"] = self.launch["num_stages"]
        return out
