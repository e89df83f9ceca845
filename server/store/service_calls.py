"""The Store's calls that its services answer as they are, each forwarded (forward.py), not
declared again: samples and leases (services/sampling.py), reads of named experiences (Get,
ReadFields, a rank's part of a lease, ListExperiences: services/reads.py), keyed values
(services/values.py) and the prompt ledger's datasets and claims (services/claims.py, over the
ledger's rules)."""

from __future__ import annotations

from .forward import Forwarded
from .services.claims import Claims
from .services.reads import Reads
from .services.sampling import Sampling
from .services.values import Values


class ServiceCalls:
    """Mixed into the Store, which makes `sampling`, `reads`, `values` and `claims`."""

    sampling: Sampling
    reads: Reads
    values: Values
    claims: Claims

    sample = Forwarded("sampling", Sampling.sample)
    ack = Forwarded("sampling", Sampling.ack)
    nack = Forwarded("sampling", Sampling.nack)
    give_back = Forwarded("sampling", Sampling.give_back)
    fail_stage = Forwarded("sampling", Sampling.fail_stage)
    confirm = Forwarded("sampling", Sampling.confirm)
    renew = Forwarded("sampling", Sampling.renew)
    release_holds = Forwarded("sampling", Sampling.release_holds)

    get = Forwarded("reads", Reads.get)
    list_experiences = Forwarded("reads", Reads.page)
    get_payload = Forwarded("reads", Reads.payload)
    get_partials = Forwarded("reads", Reads.partials)
    read_fields = Forwarded("reads", Reads.fields)
    lease_part = Forwarded("reads", Reads.part)

    put_values = Forwarded("values", Values.put)
    get_values = Forwarded("values", Values.get)
    clear_values = Forwarded("values", Values.clear)

    create_dataset = Forwarded("claims", Claims.create)
    datasets = Forwarded("claims", Claims.datasets)
    claim = Forwarded("claims", Claims.claim)
    renew_claims = Forwarded("claims", Claims.renew)
    release_claims = Forwarded("claims", Claims.release)
    report_prompts = Forwarded("claims", Claims.report)
    list_prompts = Forwarded("claims", Claims.prompts)
