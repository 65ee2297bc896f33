"""Turn the core's input errors into MCP ToolErrors a client can act on."""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from typing import Any, TypeVar

from mcp.server.mcpserver.exceptions import ToolError
from pydantic import ValidationError

log = logging.getLogger("mcore_advisor.server")

F = TypeVar("F", bound=Callable[..., Any])


def describe_validation_error(exc: ValidationError) -> str:
    """One line per bad field: dotted location, what was wrong, and the input given."""
    parts = []
    for err in exc.errors()[:8]:
        loc = ".".join(str(x) for x in err.get("loc", ())) or "input"
        parts.append(f"{loc}: {err.get('msg', 'invalid')} (got {err.get('input')!r:.60})")
    more = len(exc.errors()) - 8
    if more > 0:
        parts.append(f"... and {more} more")
    return "; ".join(parts)


def user_message(exc: BaseException) -> str:
    """The text a user sees for an error the input could fix."""
    if isinstance(exc, ValidationError):
        return describe_validation_error(exc)
    if isinstance(exc, KeyError) and exc.args:
        return str(exc.args[0])
    return str(exc)


def tool_errors(fn: F) -> F:
    """Map ValueError/KeyError/ValidationError to ToolError; hide tracebacks of the rest."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except ToolError:
            raise
        except (ValueError, KeyError, ValidationError, FileNotFoundError) as exc:
            raise ToolError(user_message(exc)) from None
        except Exception as exc:  # a bug of ours: log it, tell the client without internals
            log.exception("internal error in %s", fn.__name__)
            raise ToolError(
                f"internal error in {fn.__name__} ({type(exc).__name__}); the server log has details"
            ) from None

    return wrapper  # type: ignore[return-value]
