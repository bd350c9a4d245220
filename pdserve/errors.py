"""Errors a user can act on. Each carries a one-line message."""


class CheckpointError(ValueError):
    """A checkpoint directory cannot be loaded: names the file and what is wrong with it."""


class RequestError(ValueError):
    """A request cannot be admitted (bad sampling parameters, prompt too long, ...).

    `param` names the offending field so the server can report it in OpenAI's error format.
    """

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


class ConfigError(ValueError):
    """An engine or server option that cannot work (a device that is not there, a bound out of range)."""


class SLOUnattainable(RequestError):
    """--slo-admission reject: the request's TTFT target cannot be met, so it is refused at once
    (the server answers 503 slo_unattainable) rather than served late."""

    def __init__(self, message: str):
        super().__init__(message, param="slo")
