"""The error every app's services raise for input they refuse, so every view maps it the same way."""

from __future__ import annotations


class InvalidInput(ValueError):
    """Input a service refuses; ``field`` names what is wrong (a 400 for that field, a CLI error)."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field
        self.message = message
