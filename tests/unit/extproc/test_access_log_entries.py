"""Envoy's access-log entries as the picker reads them (issue 21 defects: IPv6 upstreams, one bad entry)."""

from __future__ import annotations

from collections.abc import AsyncIterator

from envoy.config.core.v3 import address_pb2
from envoy.data.accesslog.v3 import accesslog_pb2
from envoy.service.accesslog.v3 import als_pb2

from picker.contract import headers
from picker.extproc import translate
from picker.extproc.access_log import AccessLogService
from picker.streams import Attempts


def entry(
    request_id: str, upstream: tuple[str, int] = ("10.0.0.1", 8000)
) -> accesslog_pb2.HTTPAccessLogEntry:
    out = accesslog_pb2.HTTPAccessLogEntry()
    out.request.request_headers[headers.PICKER_REQUEST_ID] = request_id
    socket = out.common_properties.upstream_remote_address.socket_address
    socket.address, socket.port_value = upstream
    out.response.response_code.value = 200
    return out


def test_an_ipv6_upstream_is_named_as_its_endpoint_is() -> None:
    _, attempts = translate.access_log_entry(entry("r", ("fd00::1", 8000)))
    assert attempts.upstream == "[fd00::1]:8000"
    _, attempts = translate.access_log_entry(entry("r", ("10.0.0.1", 8000)))
    assert attempts.upstream == "10.0.0.1:8000"


def test_a_pipe_or_missing_upstream_is_empty() -> None:
    out = entry("r")
    out.common_properties.upstream_remote_address.CopyFrom(address_pb2.Address())
    assert translate.access_log_entry(out)[1].upstream == ""


class Path:
    """Records what reaches the request path; the first entry it is handed makes it fail."""

    def __init__(self) -> None:
        self.seen: list[str] = []

    def access_logged(self, request_id: str, attempts: Attempts) -> None:
        if not self.seen:
            self.seen.append("boom")
            raise ValueError("a defect while settling one request")
        self.seen.append(request_id)


async def messages(
    *batches: list[accesslog_pb2.HTTPAccessLogEntry],
) -> AsyncIterator[als_pb2.StreamAccessLogsMessage]:
    for batch in batches:
        message = als_pb2.StreamAccessLogsMessage()
        message.http_logs.log_entry.extend(batch)
        yield message


async def test_one_entry_that_fails_does_not_end_the_stream() -> None:
    path = Path()
    service = AccessLogService(path)  # type: ignore[arg-type]
    await service.StreamAccessLogs(messages([entry("a"), entry("b")], [entry("c")]), None)  # type: ignore[arg-type]
    assert path.seen == ["boom", "b", "c"]
    assert service.entries == 3 and service.failed == 1
