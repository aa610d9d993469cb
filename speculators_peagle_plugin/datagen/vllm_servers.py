"""The vLLM servers that give hidden states (:mod:`.served_states`): reaching one, checking
that it serves the verifier, and the errors a server's rows end in."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from ..common.errors import OneSentenceError, UserError, first_line

DEFAULT_ENDPOINT = "http://localhost:8000/v1"  # speculators' default
DOCS = "docs/training.md, 'Hidden states from vLLM servers'"


class ServerRefused(UserError):
    """A server that cannot give this run's hidden states, found before training starts."""


class ServerUnreachable(ServerRefused):
    """No server answers at ``url``; ``reason``: what the connection reported."""

    def __init__(self, message: str, url: str, reason: str):
        super().__init__(message)
        self.url, self.reason = url, reason


class ServerFailed(OneSentenceError, RuntimeError):
    """Rows whose states no server gave, after every retry, too many times in a row."""


def base_url(url: str) -> str:
    """The OpenAI base URL of a server: ``http://h:8000`` and ``http://h:8000/v1/`` ->
    ``http://h:8000/v1``."""
    url = url.rstrip("/")
    return url if url.endswith("/v1") else url + "/v1"


def server_errors() -> tuple[type[BaseException], ...]:
    """What a server that gives no usable states for a row raises: its reply refused or
    malformed, no answer, its file unreadable, or states that do not match the row."""
    import openai
    from safetensors import SafetensorError
    from speculators.data_generation.vllm_client import InvalidResponseError

    return (InvalidResponseError, openai.OpenAIError, OSError, ValueError, SafetensorError)


def server_reason(err: BaseException) -> str:
    return first_line(err)[:300]


@dataclass
class Endpoint:
    """One server: its base URL, OpenAI client and the model id it serves."""

    url: str
    client: object
    model: str = ""


def _same_model(verifier: str, served: tuple[str | None, ...]) -> bool:
    """Whether a served model id / root names the verifier: the same text, or the same
    local directory."""
    local = Path(verifier).resolve() if Path(verifier).is_dir() else None
    for name in filter(None, served):
        if name == verifier or (local is not None and Path(name).resolve() == local):
            return True
    return False


def connect(url: str, verifier: str, timeout: float) -> Endpoint:
    """The server at ``url`` if it answers and serves ``verifier``; else :class:`ServerRefused`."""
    import openai

    url = base_url(url)
    client = openai.OpenAI(base_url=url, api_key="EMPTY", max_retries=0, timeout=timeout)
    try:
        models = client.models.list().data
    except openai.APIStatusError as err:
        raise ServerRefused(
            f"{url}/models answered HTTP {err.status_code}: --vllm-endpoint must be a vLLM "
            f"server's OpenAI base URL, such as {DEFAULT_ENDPOINT}."
        ) from None
    except openai.OpenAIError as err:
        raise ServerUnreachable(
            f"No vLLM server answers at {url} ({server_reason(err)}); start one as {DOCS} shows, "
            "or correct --vllm-endpoint.",
            url,
            server_reason(err),
        ) from None
    if not models:
        raise ServerRefused(f"The vLLM server at {url} serves no model.")
    served = (models[0].id, getattr(models[0], "root", None))
    if not _same_model(verifier, served):
        raise ServerRefused(
            f"The vLLM server at {url} serves {served[0]} ({served[1]}), not the verifier "
            f"{verifier}; serve the verifier there or correct --vllm-endpoint."
        )
    return Endpoint(url, client, models[0].id)
