"""Test-only fault injection: make one request's processing raise, to show that it fails alone.

Off unless the environment variable `XLASERVE_FAULT_INJECTION` is set when a
component that owns a fault site is built (it is read once, at start-up, by
`FaultInjector.from_env`; the engine process inherits the API process's
environment). Its value is a comma-separated list of `site:regex`; a request
whose engine request id matches the regex (`re.search`) raises `InjectedFault`
at that site:

    output   API process, `OutputProcessor.process_outputs`: turning the
             request's engine output into text (detokenizer, stop strings).
             The request fails alone: HTTP 500, its blocks are freed.
    update   engine process, `Scheduler.update_from_output`: applying a step's
             sampled tokens to the request. The request fails alone, as above.
    step     engine process, `EngineCore.step`: the model step that has the
             request scheduled. An engine death: every request gets 503 and
             the server exits.

This exists for tests (tests/test_reliability.py, benchmarks/soak.py) and must
never be set on a server that takes requests from people: a client choosing a
matching request id (X-Request-Id) would trigger the fault.
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass
from typing import Mapping

from enginecore import envs

ENV = "XLASERVE_FAULT_INJECTION"
SITES = ("output", "update", "step")

logger = logging.getLogger("xlaserve.faults")


class InjectedFault(RuntimeError):
    """Raised at a fault site for a matching request (tests only)."""


@dataclass(frozen=True)
class FaultInjector:
    """Parsed `XLASERVE_FAULT_INJECTION`: (site, pattern) rules."""

    rules: tuple[tuple[str, re.Pattern], ...]

    @classmethod
    def parse(cls, spec: str) -> "FaultInjector":
        rules = []
        for item in spec.split(","):
            site, sep, pattern = item.strip().partition(":")
            if not sep or site not in SITES or not pattern:
                raise ValueError(f"{ENV}={spec!r}: each entry must be SITE:REGEX with SITE one of "
                                 f"{', '.join(SITES)}; got {item.strip()!r}")
            try:
                rules.append((site, re.compile(pattern)))
            except re.error as e:
                raise ValueError(f"{ENV}={spec!r}: {pattern!r} is not a regular expression ({e})") from None
        return cls(tuple(rules))

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> "FaultInjector | None":
        """None (the usual case) when the variable is unset or empty: call sites then cost one `is None`.
        `environ`: the process's environment unless given."""
        spec = envs.environment_variables[ENV].read(environ)
        if not spec:
            return None
        injector = cls.parse(spec)
        logger.warning("%s is set (%s): test-only fault injection is ON", ENV, spec)
        return injector

    def check(self, site: str, request_id: str) -> None:
        for s, pattern in self.rules:
            if s == site and pattern.search(request_id):
                raise InjectedFault(f"fault injected at {site!r} for request {request_id!r} ({ENV})")
