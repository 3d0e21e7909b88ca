#!/usr/bin/env bash
# Validates deploy/kubernetes offline (issue 30 §2): every manifest against the
# Kubernetes API schemas that kubernetes-validate ships (pinned in
# scripts/requirements-k8s.txt), strictly (an unknown or misspelt field fails),
# for the oldest and the newest Kubernetes it knows; and each kustomization
# rendered by `kubectl kustomize` when kubectl is installed (otherwise each file
# is still validated on its own, and said). The ServiceMonitor is a CRD no
# schema here covers: tests/it/kubernetes.rs checks it against the Services, as
# it checks every manifest against the binary. Called by scripts/test.sh.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
VERSIONS=(1.25.0 1.37.0)

PY=$(bash scripts/venv-install.sh scripts/requirements-k8s.txt)
KV=$(dirname "$PY")/kubernetes-validate

# One run of kubernetes-validate; fails on any failure and on a resource it has
# no schema for (it only warns about those).
validate() {
    local version=$1
    shift
    local out
    if ! out=$("$KV" --strict -k "$version" "$@" 2>&1); then
        echo "$out"
        echo "k8s-validate: invalid against Kubernetes $version" >&2
        return 1
    fi
    if grep -q "Couldn't find schema" <<<"$out"; then
        echo "$out"
        echo "k8s-validate: a resource no schema covers (Kubernetes $version)" >&2
        return 1
    fi
    echo "$out" | grep -c "passed for resource" | sed "s/^/Kubernetes $version: resources passed: /"
}

mapfile -t files < <(find deploy/kubernetes -name '*.yaml' ! -name kustomization.yaml \
    ! -path 'deploy/kubernetes/monitoring/*' | sort)
[ ${#files[@]} -gt 0 ] || { echo "k8s-validate: no manifests" >&2; exit 1; }
echo "k8s-validate: ${#files[@]} files: ${files[*]}"
for v in "${VERSIONS[@]}"; do
    validate "$v" "${files[@]}"
done

if command -v kubectl >/dev/null 2>&1 && kubectl kustomize --help >/dev/null 2>&1; then
    tmp=$(mktemp -d)
    trap 'rm -rf "$tmp"' EXIT
    for k in deploy/kubernetes/*/kustomization.yaml; do
        dir=$(dirname "$k")
        kubectl kustomize "$dir" >"$tmp/$(basename "$dir").yaml"
        for v in "${VERSIONS[@]}"; do
            echo -n "$dir rendered by kubectl kustomize, "
            validate "$v" "$tmp/$(basename "$dir").yaml"
        done
    done
else
    echo "k8s-validate: kubectl not installed: the kustomizations were not rendered (each file was validated on its own)"
fi
echo "k8s-validate: ok"
