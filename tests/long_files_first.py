"""xdist's ``--dist loadfile`` scheduler, with the suite's longest files sent first.

xdist orders files by their number of tests, so one- and two-test files run last: a file of one
minutes-long test (schemathesis) then started last and the other worker idled for its length.
Sending the longest files first (longest-processing-time order) lets the short ones fill in at
the end. Files not named keep xdist's order, after these."""

from __future__ import annotations

from typing import Any

# Longest first, as measured in full runs here (seconds per file, roughly): keep it to the files
# of minutes; a file missing from the tree is ignored.
LONG_FILES = (
    "tests/test_convert.py",
    "tests/test_structured_output.py",
    "tests/test_server_openapi.py",
    "tests/test_agent_clients.py",
    "tests/test_cache.py",
    "tests/test_real_model.py",
    "tests/test_gguf_smollm.py",
    "tests/test_server_api.py",
    "tests/test_server_tools.py",
    "tests/test_anthropic_api.py",
    "tests/test_distributed.py",
    "tests/test_decoding.py",
    "tests/test_engine_speculative.py",
    "tests/test_speculative.py",
)


def long_files_first(files: list[str]) -> list[str]:
    """``files`` (in xdist's order) with ``LONG_FILES`` first, in that order; the others keep
    their order after them."""
    rank = {name: i for i, name in enumerate(LONG_FILES)}
    return sorted(files, key=lambda name: rank.get(name, len(LONG_FILES)))


def make_scheduler(config: Any, log: Any) -> Any:
    """A ``LoadFileScheduling`` whose queue of files is put in ``long_files_first`` order
    before the first file is handed out (the workers' collections, which the queue's test
    indices refer to, are left as they are)."""
    from collections import OrderedDict

    from xdist.scheduler import LoadFileScheduling

    class LongFilesFirst(LoadFileScheduling):
        ordered = False

        def _assign_work_unit(self, node: Any) -> None:
            if not self.ordered:  # the queue is complete: schedule() fills it, then assigns
                self.ordered = True
                self.workqueue = OrderedDict((f, self.workqueue[f]) for f in long_files_first(list(self.workqueue)))
            super()._assign_work_unit(node)

    return LongFilesFirst(config, log)
