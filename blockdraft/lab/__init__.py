"""The lab beside the product: what measures and studies the engine (profiling a step's parts,
ablation studies, peers run side by side), imported by the commands that report them, never by
the decoding path."""
