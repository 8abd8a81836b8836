"""Content routing: which draft adapter serves a request that names none.

Owns: prompt features (``features``, pure), the routing model and its fit (``model``, pure:
numpy and safetensors) and its codec for the versioned store (``store``: its versions live in
the log's Redis through ``osd.versions``, beside the accuracy points). The trainer fits and
publishes models (``trainer.routing``); replicas load them and route by them
(``serving.router``, ``serving.router_trial``). Imports only ``osd.versions`` and the buffer's
Redis helpers; never the decode path, serving, the trainer or the launcher.
"""

from osd.routing.features import prompt_features, stack_features
from osd.routing.model import RoutingModel, fit_routing_model

__all__ = ["RoutingModel", "fit_routing_model", "prompt_features", "stack_features"]
