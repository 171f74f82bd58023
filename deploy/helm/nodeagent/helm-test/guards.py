# helm test's check (templates/tests/guards.yaml): nodeagent_guard_ok from /metrics through
# the kube-rbac-proxy, with this pod's token; the proxy's certificate is self-signed.
import os
import ssl
import sys
import urllib.request

url = os.environ["METRICS_URL"]
token_file = os.environ.get("TOKEN_FILE", "/var/run/secrets/kubernetes.io/serviceaccount/token")
with open(token_file) as f:
    token = f.read().strip()
context = ssl.create_default_context()
context.check_hostname = False
context.verify_mode = ssl.CERT_NONE
request = urllib.request.Request(url, headers={"Authorization": "Bearer " + token})
try:
    with urllib.request.urlopen(request, context=context, timeout=10) as response:
        body = response.read(4 << 20).decode("utf-8", "replace")
except OSError as exc:
    sys.exit(f"{url}: {exc}")
verdicts = [line for line in body.splitlines() if line.startswith("nodeagent_guard_ok{")]
for line in verdicts:
    print(line)
if not verdicts:
    sys.exit(f"{url}: no nodeagent_guard_ok in /metrics")
print(f"{len(verdicts)} guard verdicts read through the proxy ({url})")
