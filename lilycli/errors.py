"""The one exception type the CLI turns into a message and an exit code (never a traceback)."""


class LilyError(Exception):
    """A failure the user can act on: `message` says what happened and what to do next."""

    def __init__(self, message: str, exit_code: int = 1, details: list[str] | None = None):
        super().__init__(message)
        self.message = message
        self.exit_code = exit_code
        # Extra lines shown under the message, e.g. the engine's last log lines.
        self.details = details or []
