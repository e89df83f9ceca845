"""The servicers of the ExperienceBuffer's services, each a mixin of rpc/service.py's servicer,
which provides the store, its largest message and the caller's token fingerprint: the reads of
named experiences (reads.py), the prompt ledger's calls (ledger.py), the off-policy bound's
(offpolicy.py: trainer versions, admission), tables and the server's own (tables.py: create,
list, drop, stats, server info, writers) and keyed values (values.py), over what they all have
of it (base.py: the store, the largest message, the caller's fingerprint).

May import sample/ (the replies), the service's shared modules and interceptors/.
"""
