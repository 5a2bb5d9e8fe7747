"""The tests' helpers, a module each, importable from every tier (pyproject's pythonpath puts
tests/ first): what the tests do alike, and the real systems they stand up.

- runs: the trainer launched as a user does (plain, under torchrun, several at once), forked
  from preloaded (the interpreter that imported torch, transformers and datasets once);
- models, weights: tiny random-init classifiers, and a run's weights compared;
- outputs, processes, web: a run's files read, processes against a deadline, files on
  loopback HTTP;
- netns, multinode, slurm_cluster, image: hosts as network namespaces, a torchrun per host, a
  real Slurm cluster, the app image built by buildah and run by podman;
- kubeflow, katib, k8s_pss: the operators' and the restricted standard's rules, ported as
  oracles; fake_hub, wandb_log, users, slurm_stand_ins, fsdp_shards, plain_logits: stand-ins
  and programs the tests run;
- kill_drill, determinism_check: `make kill-drill`, and the check benchmarks/gpu.sh runs.

conftest.py keeps the fixtures and the hooks that mark and order the tiers.
"""
