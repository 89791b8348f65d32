"""Kubernetes objects generated from the sources the rest of gpuscope uses (``deploy/kubernetes``).

- ``config``: the cluster it is deployed into (namespaces, kube-prometheus-stack's release and
  services, scrape interval), the autoscaling targets, workload names, the image tags;
- ``monitoring``: the Prometheus Operator's PrometheusRule (the alert config's production rule
  groups) and ServiceMonitors, the Alertmanager configuration Secret (the alert config's routing),
  Grafana dashboard and datasource ConfigMaps for the kube-prometheus-stack sidecar;
- ``autoscaling``: prometheus-adapter rules and the HorizontalPodAutoscaler of the server;
- ``generate``: ``gpuscope generate`` writes ``deploy/kubernetes/generated/``;
- ``render``: ``python -m gpuscope.kube.render [--check]`` renders each overlay with
  ``kubectl kustomize`` into ``deploy/kubernetes/rendered/`` (what the offline validation reads).
"""
