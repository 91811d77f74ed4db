"""The ingress: the HTTP API (OpenAI Images compatible) and the Python API for handle callers.

It checks every request against the deployment's limits before a replica sees it, gives it
an id and a seed (so a retried request makes the same image), forwards it to the replicas
through a `DeploymentHandle`, and turns every failure into one `ServingError`. No diffusers
and no torch here. Layout: `core` (what every route shares), one module per API (`images`,
`jobs`, `requests`, `admin`, `ops`), `present` (how results look), `http` (the app) and
`deployment` (the Serve class).
"""
