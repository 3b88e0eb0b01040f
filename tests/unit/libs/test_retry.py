"""libs.retry.with_backoff: how many attempts, which errors are retried, and the pauses between them."""

from __future__ import annotations

from collections.abc import Awaitable, Callable

import pytest

from agentmesh.libs.retry import with_backoff


class Flaky(Exception):
    pass


def calls(*outcomes: BaseException | str) -> tuple[list[int], Callable[[], Awaitable[str]]]:
    """An async callable giving `outcomes` in turn (raising the exceptions), and the list of its calls."""
    made: list[int] = []

    async def call() -> str:
        made.append(len(made))
        outcome = outcomes[len(made) - 1]
        if isinstance(outcome, BaseException):
            raise outcome
        return outcome

    return made, call


async def test_retried_until_it_succeeds_with_doubling_capped_pauses() -> None:
    made, call = calls(Flaky(), Flaky(), Flaky(), "ok")
    pauses: list[float] = []
    got = await with_backoff(
        call,
        retry_on=Flaky,
        retries=5,
        delay_s=0.001,
        max_delay_s=0.003,
        on_retry=lambda _, pause: pauses.append(pause),
    )
    assert (got, len(made), pauses) == ("ok", 4, [0.001, 0.002, 0.003])


async def test_the_last_attempts_error_is_raised_after_the_retries() -> None:
    last = Flaky("third")
    made, call = calls(Flaky("first"), Flaky("second"), last, "never")
    with pytest.raises(Flaky) as err:
        await with_backoff(call, retry_on=(Flaky, TimeoutError), retries=2, delay_s=0.001)
    assert err.value is last and len(made) == 3


@pytest.mark.parametrize("retries", [0, -1])
async def test_no_retries_is_one_attempt(retries: int) -> None:
    made, call = calls(Flaky(), "never")
    with pytest.raises(Flaky):
        await with_backoff(call, retry_on=Flaky, retries=retries, delay_s=0.001)
    assert len(made) == 1


async def test_an_error_not_retried_is_raised_at_once() -> None:
    made, call = calls(Flaky(), ValueError("bad"), "never")
    pauses: list[float] = []
    with pytest.raises(ValueError, match="bad"):
        await with_backoff(
            call,
            retry_on=Flaky,
            retries=5,
            delay_s=0.001,
            on_retry=lambda _, pause: pauses.append(pause),
        )
    assert len(made) == 2 and pauses == [0.001]
