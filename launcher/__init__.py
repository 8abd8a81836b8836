"""The app layer: the ``osd`` command line, the embedded local stack and the demo driver.

Owns: the CLI entry point (``cli``), the local stack that runs a private redis-server, local Ray,
the Serve app and the trainer (``stack``, kept alive by ``supervisor``; ``up`` runs it until
stopped) and ``osd demo``, the main job (``demo_job`` with its traffic, live view and report).
The only package that imports both ``serving`` and ``trainer``; nothing imports it.
"""
