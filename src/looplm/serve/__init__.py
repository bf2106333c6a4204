"""Serving: KV cache, exit policies, the engine, and static / sequence-wise / depth-wise schedulers."""

from .cache import KVCache
from .engine import Engine
from .exits import ExitPolicy, parse_policy
from .request import Request
from .sampling import RequestError, SamplingParams
from .schedulers import SCHEDULERS, generate, make_scheduler, replay, warm_up

__all__ = [
    "KVCache",
    "Engine",
    "Request",
    "ExitPolicy",
    "parse_policy",
    "RequestError",
    "SamplingParams",
    "SCHEDULERS",
    "make_scheduler",
    "replay",
    "generate",
    "warm_up",
]
