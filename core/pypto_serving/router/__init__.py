"""``pypto-serving router``: one OpenAI API in front of many serving replicas (docs/router.md)."""

from .app import build_router_app
from .config import ReplicaConfig, RouterSettings
from .routing import Router, rendezvous_order, request_profile

__all__ = ["ReplicaConfig", "Router", "RouterSettings", "build_router_app", "rendezvous_order", "request_profile"]
