"""Envoy's gRPC access log service: how each request really ended on the wire.

Envoy knows what the ext_proc streams cannot tell: whether the client or the model server closed a
stream early (response flags), and how many upstream attempts a request took. Entries arrive a
moment after each request ends; they never block traffic.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Callable

import grpc
from envoy.service.accesslog.v3 import als_pb2, als_pb2_grpc

from picker.extproc import translate
from picker.request.pipeline import RequestPath

log = logging.getLogger(__name__)


class AccessLogService(als_pb2_grpc.AccessLogServiceServicer):
    def __init__(self, path: RequestPath, on_failure: Callable[[], None] = lambda: None) -> None:
        self._path = path
        self._on_failure = on_failure
        self.entries = 0
        self.failed = 0  # entries whose handling raised: logged and skipped, the stream goes on

    async def StreamAccessLogs(
        self,
        request_iterator: AsyncIterator[als_pb2.StreamAccessLogsMessage],
        context: grpc.aio.ServicerContext,
    ) -> als_pb2.StreamAccessLogsResponse:
        async for message in request_iterator:
            for entry in message.http_logs.log_entry:
                self.entries += 1
                try:
                    request_id, attempts = translate.access_log_entry(entry)
                    if request_id:
                        self._path.access_logged(request_id, attempts)
                except Exception:
                    # One entry must not end the stream: Envoy would drop the entries it buffers
                    # until it reconnects, and with them the ends of other requests.
                    self.failed += 1
                    self._on_failure()
                    log.exception("access-log entry could not be handled; skipped")
        return als_pb2.StreamAccessLogsResponse()
