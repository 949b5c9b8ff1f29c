"""`picker proxy`: the standalone streaming reverse proxy, a second frontend over the same core.

HTTP in (server.py), core calls (picker/request/pipeline.py), HTTP out (upstream.py); translate.py holds the
HTTP <-> core mapping. No scheduling or tracking logic lives here.
"""
