"""Each room of the package imports only from rooms below it (functional at the bottom, the CLI at the top),
so that a new room can be placed, and an asynchronous producer plugged in, without import cycles."""

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "gacbench"

# rank of each room (a sub-package, or a top-level module); a room may import rooms of a strictly lower rank
RANK = {
    "usage": -1,  # UsageError, raised by every room (it imports nothing of the package)
    "lazy": -1,  # the packages' attributes imported on first access (it imports nothing of the package)
    "functional": 0, "loggers": 0, "jsonio": 0, "trainer": 0, "provenance": 0,
    "callbacks": 1, "hooks": 1,
    "stabilizers": 2,
    "rollout": 3, "methods": 3,
    "objectives": 4,
    "theory": 5, "llm": 5,
    "bench": 6,
    "__init__": 6,
    "cli": 7, "__main__": 7, "integrations": 7,
}


def _imports(path: Path) -> set[str]:
    rooms = set()
    for node in ast.walk(ast.parse(path.read_text())):
        names = []
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module]
        elif isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        for name in names:
            parts = name.split(".")
            if parts[0] == "gacbench":
                rooms.add(parts[1] if len(parts) > 1 else "__init__")
    return rooms


def test_every_room_imports_only_from_rooms_below_it():
    wrong = []
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE)
        room = rel.parts[0] if len(rel.parts) > 1 else rel.stem
        assert room in RANK, f"{rel}: room {room!r} has no rank in this test; give it one"
        for target in _imports(path) - {room}:
            assert target in RANK, f"{rel} imports gacbench.{target}, which has no rank in this test"
            if RANK[target] >= RANK[room]:
                wrong.append(f"{rel} ({room}, rank {RANK[room]}) imports {target} (rank {RANK[target]})")
    assert not wrong, "imports that run upward or sideways:\n" + "\n".join(wrong)
