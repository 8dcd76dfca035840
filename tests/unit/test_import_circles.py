"""No circles of imports between the modules of dockyard/ and services/.

A circle makes import order matter (a half-initialised module seen from the other side), and it
means two modules are one unit split across two files. An import inside a function or under
TYPE_CHECKING does not remove a circle, it only defers or hides it, so those count (see
tests/unit/project_imports.py for how imports are read). The graph's circles are its strongly
connected components of more than one module.
"""

from __future__ import annotations

from collections.abc import Mapping, Set

from tests.unit.project_imports import import_graph


def circles(graph: Mapping[str, Set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one node, each sorted, in sorted order
    (Tarjan's algorithm, iterative so that a deep chain of imports cannot overflow the stack)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph.get(root, ()))))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, successors = work[-1]
            step = next(successors, None)
            if step is not None:
                if step not in index:
                    index[step] = low[step] = len(index)
                    stack.append(step)
                    on_stack.add(step)
                    work.append((step, iter(sorted(graph.get(step, ())))))
                elif step in on_stack:
                    low[node] = min(low[node], index[step])
                continue
            work.pop()
            if work:
                parent = work[-1][0]
                low[parent] = min(low[parent], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return sorted(found)


def test_the_detector_finds_each_circle_and_nothing_else() -> None:
    graph = {
        "a": {"b"},
        "b": {"a", "c"},  # a <-> b, and on to c
        "c": {"d"},
        "d": {"e"},
        "e": {"c", "x"},  # c -> d -> e -> c; x is a leaf named only as a target
        "f": {"f"},  # a module importing itself is no circle between modules
        "g": {"a", "c"},  # leads into circles without being in one
        "h": set(),
    }
    assert circles(graph) == [["a", "b"], ["c", "d", "e"]]
    assert circles({"a": {"b"}, "b": {"c"}, "c": set()}) == []
    chain = {str(i): {str(i + 1)} for i in range(5000)} | {"5000": {"0"}}
    assert len(circles(chain)[0]) == 5001  # deeper than the interpreter's recursion limit


def test_no_module_is_in_a_circle_of_imports() -> None:
    found = circles(import_graph())
    assert not found, "circles of imports (make the shared piece a module both import, or invert one):\n" + "\n".join(
        " <-> ".join(c) for c in found
    )
