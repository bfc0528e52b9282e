"""The collector is told at init() to leave the imports alone (mpitrain.core.collector)."""

from __future__ import annotations

import subprocess
import sys
import textwrap


def _run(code: str) -> str:
    done = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True,
                          text=True, timeout=120, check=True)
    return done.stdout.strip()


def test_the_first_call_freezes_what_is_alive_and_not_the_garbage():
    out = _run("""
        import gc, torch
        from mpitrain.core import collector
        freed = []
        class Cycle:
            def __del__(self):
                freed.append(True)
        garbage = Cycle(); garbage.me = garbage  # like an unclosed socket in a cycle
        del garbage
        before = len(gc.get_objects())
        assert collector.freeze_imports(True)
        assert freed == [True]  # collected first, not frozen with the living
        frozen = gc.get_freeze_count()
        assert frozen >= 0.9 * before, (frozen, before)  # the imports: out of every collection
        assert len(gc.get_objects()) < 0.1 * before
        assert not collector.freeze_imports(True)  # a later init() freezes nothing more
        assert gc.get_freeze_count() == frozen
        print("ok")
    """)
    assert out == "ok"


def test_off_or_with_the_collector_disabled_nothing_is_frozen():
    out = _run("""
        import gc
        from mpitrain.core import collector
        assert not collector.freeze_imports(False)
        gc.disable()
        assert not collector.freeze_imports(True)
        print(gc.get_freeze_count())
    """)
    assert out == "0"
