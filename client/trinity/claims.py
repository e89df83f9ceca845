"""A taskset reader's claims on its prompts, renewed while the explorer lives, so that they can be short.

Trinity's explorer reads a step's tasks, runs them, and writes their experiences only when it
finalizes the step, some steps later. A claim long enough for all of that would leave a killed
explorer's prompts out of reach as long. Instead each claim is short and a background thread
renews every claim the reader holds a third of a claim apart (two renewals in a row may fail
before a claim ends). A claim whose group is complete ends (its prompt is generated) and is
dropped at its next renewal; one held `hold` seconds is renewed no more, so that a task that
never made a group (every run failed) goes out again with its next attempt. The thread stops
when the reader is closed or collected, and dies with its process: a killed explorer's prompts
go out again within one claim. The thread is the one that renews a reader's leases
(expbuf.client.kit.lease_keeper.Renewer).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable

from expbuf.client.client import BufferClient, BufferError
from expbuf.client.kit.lease_keeper import RENEWALS_PER_LEASE, Renewer
from expbuf.client.schema.prompts import Prompt

log = logging.getLogger(__name__)
RENEWALS_PER_CLAIM = RENEWALS_PER_LEASE
_Key = tuple[str, str, int, int, int]


def _key(prompt: Prompt) -> _Key:
    return prompt.table, prompt.dataset, prompt.epoch, prompt.index, prompt.attempt


class ClaimKeeper(Renewer[_Key, tuple[Prompt, float]]):
    """Renews the claims it holds every `seconds / 3`, each for `seconds` more, for at most
    `hold` seconds after it took them, until closed."""

    def __init__(
        self, client: BufferClient, seconds: float, hold: float, clock: Callable[[], float] = time.monotonic
    ) -> None:
        super().__init__(client, seconds, "expbuf-claim-keeper")
        self._hold, self._clock = hold, clock
        self._renewing = threading.Lock()  # one renewal at a time: the thread's, or held()'s

    def hold(self, prompts: Iterable[Prompt]) -> None:
        """Keep these claims until their groups are complete, they end, or `hold` seconds pass."""
        until = self._clock() + self._hold
        self._keep({_key(prompt): (prompt, until) for prompt in prompts})

    def let_go(self, prompts: Iterable[Prompt]) -> None:
        """Renew these claims no more (their prompts were released)."""
        with self._lock:
            for prompt in prompts:
                self._held.pop(_key(prompt), None)

    def held(self) -> list[Prompt]:
        """The claims still held, renewed now: those whose group is complete, or that ended, are
        dropped first."""
        self._renew_held()
        with self._lock:
            return [prompt for prompt, _ in self._held.values()]

    def _renew_held(self) -> None:
        with self._renewing:
            now = self._clock()
            with self._lock:
                expired = [key for key, (_, until) in self._held.items() if until <= now]
                for key in expired:
                    prompt, _ = self._held.pop(key)
                    log.warning(
                        "expbuf: prompt %s/%d/%d (attempt %d) held %g s without its group completing; its claim is "
                        "let go and the prompt goes out again",
                        prompt.dataset, prompt.epoch, prompt.index, prompt.attempt, self._hold,
                    )  # fmt: skip
                prompts = [prompt for prompt, _ in self._held.values()]
            if not prompts or self._stop.is_set():
                return
            try:
                ended = self._client.renew_claims(prompts, self._seconds)
            except BufferError as exc:
                log.warning("expbuf: %d claims not renewed (%s); retrying in %.3g s", len(prompts), exc, self.period)
                return
            with self._lock:
                for prompt in ended:  # generated (its group complete), or its claim ended
                    self._held.pop(_key(prompt), None)
