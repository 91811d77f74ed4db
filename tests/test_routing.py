"""Serve's private `RequestRoutingInfo`, the one private import (serve_app/replica/routing.py):
this fails loudly if a Ray upgrade moves or changes it, instead of adapter affinity quietly
going away."""

from __future__ import annotations

import inspect

from serve_app.replica.routing import routing_info_class


def test_request_routing_info_still_takes_what_we_send():
    cls = routing_info_class()
    params = inspect.signature(cls).parameters
    assert {"replica_id", "multiplexed_model_ids"} <= set(params), params


def test_the_serve_client_still_records_it():
    from ray.serve._private.client import ServeControllerClient

    assert callable(getattr(ServeControllerClient, "record_request_routing_info", None))
