"""The books shared between pickers: several pickers count every request on every endpoint.

`books.py` (core, no I/O) keeps the account of other pickers' requests and what to tell them;
`events.py` (core) is the events' shape, validated whole before they change anything. The transport
is the edge: `channel.py` sends and finds peers, `inbox.py` receives, `outbox.py` batches what one
loop turn says, `auth.py` proves who is talking (an HMAC over a challenge, the credential never sent),
`moves.py` asks every peer to move its streams off a draining replica (`?move_streams=true`).
The transport may import the core; the core imports nothing of the transport.
"""
