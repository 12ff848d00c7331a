"""The background tasks of one cluster service (copies pushed, slots moved), kept so they can be
awaited or cancelled together when the node leaves."""
from __future__ import annotations

import asyncio


class BackgroundTasks(set):
    """A set of running tasks: each leaves the set when it ends."""

    def spawn(self, coro) -> asyncio.Task:
        task = asyncio.get_running_loop().create_task(coro)
        self.add(task)
        task.add_done_callback(self.discard)
        return task

    def cancel_all(self) -> None:
        for task in list(self):
            task.cancel()
