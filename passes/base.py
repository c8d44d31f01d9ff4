"""What every graph pass is: a named object with `run(model) -> PassResult`.

`RewritePass` is the shared base for pattern passes: it visits anchor nodes in topological
order, asks `rewrite(graph, anchor)` for a `Rewrite` (None means no match), refuses matches that
overlap an accepted one or whose intermediates are read outside the match, commits all accepted
matches in one batch, then removes dead nodes and re-sorts once. A match whose commit would break
the graph (a value still needed but no longer computed, a cycle) is skipped, not committed.
Every refused or skipped match is counted with its reason (`PassResult.skipped`), which the
pipeline's report shows.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import onnx

from llmc.passes.graph import Graph, Rewrite
from llmc.passes.opsets import default_opset, require_opset


@dataclass
class PassResult:
    """What a pass did: the model, how many patterns it rewrote, and notes for the report.

    `skipped` counts the matches found but left alone, by reason ("'x' inside the match is read
    elsewhere": 2).
    """

    model: onnx.ModelProto
    matches: int
    notes: list[str] = field(default_factory=list)
    skipped: dict[str, int] = field(default_factory=dict)

    @property
    def changed(self) -> bool:
        return self.matches > 0


class Pass:
    """A graph transformation. Subclasses set `name` and implement `run`."""

    name: str = ""

    def run(self, model: onnx.ModelProto) -> PassResult:
        raise NotImplementedError


class RewritePass(Pass):
    """A pattern pass. Subclasses set `anchors` (op types) and implement `rewrite`."""

    anchors: tuple[str, ...] = ()
    anchor_domain: str = ""
    # The default-domain opset the emitted ops need; the model is upgraded only on a match.
    opset: int | None = None
    # The op this pass emits and why, reported when it matched (the per-backend choice).
    target: str = ""
    # A non-default domain the emitted ops live in (e.g. "com.microsoft"), imported on a match.
    domain: str | None = None

    def rewrite(self, graph: Graph, anchor: onnx.NodeProto) -> Rewrite | None:
        raise NotImplementedError

    def prepare(self, graph: Graph) -> str | None:
        """Check the pass applies at all; a returned string is why not (for the report)."""
        return None

    def run(self, model: onnx.ModelProto) -> PassResult:
        graph = Graph(model)
        reason = self.prepare(graph)
        if reason:
            return PassResult(model, 0, [reason])
        accepted = self._match(graph)
        notes = [] if accepted else [self._why_no_match(graph)]
        if accepted and self.opset and default_opset(model) < self.opset:
            # Upgrade first (the converter must not meet the new ops), then match again on the
            # upgraded graph, whose nodes the converter may have rewritten.
            notes.append(f"opset {default_opset(model)} → {self.opset}")
            require_opset(model, self.opset)
            graph = Graph(model)
            accepted = self._match(graph)
        matches = 0
        if accepted:
            skipped = graph.apply(accepted)
            for _, reason in skipped:
                self._skip(reason)
            matches = len(accepted) - len(skipped)
            if matches and self.domain:
                require_opset(model, 1, self.domain)
            if matches and self.target:
                notes.append(f"target: {self.target}")
        notes += [f"skipped {count} match(es): {kind}" + (f" (first: '{self._examples[kind]}')"
                                                          if self._examples[kind] else "")
                  for kind, count in self._skipped.items()]
        return PassResult(model, matches, notes, dict(self._skipped))

    def _match(self, graph: Graph) -> list[Rewrite]:
        accepted: list[Rewrite] = []
        claimed: set[int] = set()
        self._skipped: dict[str, int] = {}
        self._examples: dict[str, str | None] = {}
        for node in self._anchors(graph):
            if id(node) in claimed:
                continue
            rewrite = self.rewrite(graph, node)
            if rewrite is None:
                continue
            reason = graph.conflict(rewrite, claimed)
            if reason is not None:
                self._skip(reason)
                continue
            accepted.append(rewrite)
            claimed.update(id(n) for n in rewrite.remove)
        return accepted

    def _skip(self, reason: str) -> None:
        # Value names differ per layer: count by the reason with the name left out, so a report
        # says "skipped 22 match(es): a value inside the match is read elsewhere" once.
        parts = reason.split("'")
        kind = f"a value{parts[2]}" if len(parts) == 3 and parts[0] == "" else reason
        if kind not in self._skipped:
            self._examples[kind] = parts[1] if kind != reason else None
        self._skipped[kind] = self._skipped.get(kind, 0) + 1

    def _anchors(self, graph: Graph) -> list[onnx.NodeProto]:
        return [n for n in graph.graph.node if n.op_type in self.anchors and n.domain == self.anchor_domain]

    def _why_no_match(self, graph: Graph) -> str:
        """The report line for a pass that changed nothing."""
        examined = len(self._anchors(graph))
        if not examined:
            return f"no match: no {'/'.join(self.anchors)} nodes"
        if self._skipped:
            return f"no match: {sum(self._skipped.values())} pattern(s) found but left alone"
        return f"no match: {examined} {'/'.join(self.anchors)} node(s) examined, none in the pattern"
