"""Does the Flax model compute what its torch twin computes? ``compare`` (one pair, a report),
``verify`` (the tables of the ``verify`` command), ``bisect`` (the first module that diverges,
against float64 torch), ``certificate`` (an export's certificate: made, read and re-checked;
what it records and its schema in ``certificate.schema``), ``export`` (certified writers), ``certificate.subjects`` (a checkpoint or a user's
``MODULE:FACTORY`` as a pair, example inputs, what a certificate is about).

One measuring core (``measure``: the float64 reference, torch at a lower precision, the fp32 twin,
gradients, the distances), one budget rule (``precision``), one report protocol (``reports.Report``)
and one certificate flow (``certificate``, with its subjects in ``certificate.subjects`` and
``certificate.peft``) serve all of them.

Imports ``models`` and ``interop`` only; torch lazily.
"""
