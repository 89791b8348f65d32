"""Kernel profiles on demand (``gpuscope serve --profile.enable``; docs/server.md, "Kernel profiles
on an alert").

- ``config``: the ``--profile.*`` settings, validated in one place;
- ``capture``: :class:`~gpuscope.server.profile.capture.ProfileCapture`, which admits a request and
  drives a capture across the next engine steps;
- ``recorders``: what records those steps (torch.profiler's kernels on CUDA, else the timer's regions);
- ``trace``: the Chrome trace files, capped, written atomically, pruned;
- ``api``: the ``/admin/profile`` routes.
"""
