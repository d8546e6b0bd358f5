"""Domain exceptions shared by the services.

Core code raises these; each service's interceptor maps them to a gRPC status code with the
message unchanged, so every message must tell a person what was wrong and what is allowed.
"""


class ConveyorError(Exception):
    """Base of every error Conveyor raises on purpose."""


class InvalidRequest(ConveyorError, ValueError):
    """A request field is out of range (gRPC INVALID_ARGUMENT)."""


class PromptTooLong(InvalidRequest):
    """Prompt plus max_tokens exceed the model's context (gRPC INVALID_ARGUMENT)."""


class QueueFull(ConveyorError):
    """The scheduler's waiting queue is at its limit (gRPC RESOURCE_EXHAUSTED)."""


class UnknownRequest(ConveyorError, KeyError):
    """A request id the scheduler does not know (gRPC NOT_FOUND)."""

    def __str__(self) -> str:  # KeyError quotes its argument; keep the message readable
        return str(self.args[0]) if self.args else "unknown request"


class RequestExists(ConveyorError):
    """A request id that is already running (gRPC ALREADY_EXISTS)."""


class Unauthenticated(ConveyorError):
    """A call without the credential the service asks for, or with one it does not accept
    (gRPC UNAUTHENTICATED)."""


class PermissionDenied(ConveyorError):
    """The caller is known but may not do what it asked (gRPC PERMISSION_DENIED)."""


class ModelNotFound(ConveyorError):
    """A model name this service does not serve (gRPC NOT_FOUND)."""


class OutOfBlocks(ConveyorError):
    """The KV block pool cannot hold what was asked (internal: triggers preemption)."""


class ModelLoadError(ConveyorError):
    """A model directory is missing a file, has wrong shapes or an unsupported architecture."""


class ConfigError(ConveyorError, ValueError):
    """A configuration value is invalid; the message names the value and the allowed range."""


class PipelineUnavailable(ConveyorError):
    """No whole pipeline can serve right now (gRPC UNAVAILABLE)."""


class RequestFailed(ConveyorError):
    """The pipeline gave up on a request (gRPC INTERNAL, with the stage's reason)."""


class StateStoreError(ConveyorError):
    """Redis could not be reached or answered an error; state is left as it was."""


class StoreLost(StateStoreError):
    """The store lost state that was written to it (Redis restarted empty or from an older
    snapshot, keys evicted): the scheduler, whose memory is the source of truth while it
    lives, must write every live request again."""
