"""The books shared between pickers: several pickers count every request on every endpoint.

`books.py` (core, no I/O) keeps the account of other pickers' requests and what to tell them;
`events.py` (core) is the shape of events, asks and answers, validated whole before they change
anything; `outbox.py` (core) batches what one loop turn says. The transport is the edge: `auth.py`
is the mutual handshake (both sides prove the credential, never sent, over both nonces and names),
`session.py` the sealed frames after it (a MAC with a sequence number), `listener.py` the peer
port (bounded for strangers), `inbox.py` what each connection may do and applies it, `channel.py`
sends and finds peers, `asks.py` asks one peer a question (its drain records, or to move its
streams), `moves.py` asks every peer to move its streams off a draining replica
(`?move_streams=true`). The transport may import the core; the core imports nothing of the transport.
"""
