"""Envoy's gRPC access log service: how each request really ended on the wire.

Envoy knows what the ext_proc streams cannot tell: whether the client or the model server closed a
stream early (response flags), and how many upstream attempts a request took. Entries arrive a
moment after each request ends; they never block traffic.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator

import grpc
from envoy.service.accesslog.v3 import als_pb2, als_pb2_grpc

from picker.extproc import translate
from picker.pipeline import RequestPath

log = logging.getLogger(__name__)


class AccessLogService(als_pb2_grpc.AccessLogServiceServicer):
    def __init__(self, path: RequestPath) -> None:
        self._path = path
        self.entries = 0

    async def StreamAccessLogs(
        self,
        request_iterator: AsyncIterator[als_pb2.StreamAccessLogsMessage],
        context: grpc.aio.ServicerContext,
    ) -> als_pb2.StreamAccessLogsResponse:
        async for message in request_iterator:
            for entry in message.http_logs.log_entry:
                self.entries += 1
                request_id, attempts = translate.access_log_entry(entry)
                if request_id:
                    self._path.access_logged(request_id, attempts)
        return als_pb2.StreamAccessLogsResponse()
