#!/usr/bin/env bash
# Build the vllm-ddtree image and label it with what was really applied.
#
#   tools/build-image.sh [-t NAME:TAG] [more `docker build` arguments...]
#
# 1. `docker build` with the pins from UPSTREAM (base image, vLLM version) and the
#    OCI labels known before the build (revision, creation time, source).
# 2. Reads the series manifest back from the built image with deploy/check_install.py
#    (the same check the Dockerfile runs), so the labels are taken from the image itself.
# 3. Adds those as labels (series sha256, vllm_ddtree version, patch count) with a
#    one-line `FROM` build on top; no layer is added.
#
# DDTREE_VLLM=V builds the image of pin V (one of UPSTREAM's PINS=): FROM its
# BASE_IMAGE, its series chosen by apply.sh from the image's vLLM.
# DOCKER names the docker client to use (default: docker).
set -euo pipefail

die() {
    printf 'build-image: error: %s\n' "$*" >&2
    exit 1
}

root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$root"
docker=${DOCKER:-docker}

pin_file=UPSTREAM
if [[ -n ${DDTREE_VLLM:-} && $DDTREE_VLLM != "$(sed -n 's/^VLLM_VERSION=//p' UPSTREAM | tail -n 1)" ]]; then
    pin_file=patches/vllm-$DDTREE_VLLM/UPSTREAM
    [[ -f $pin_file ]] || die "no pin file $pin_file: DDTREE_VLLM must be one of UPSTREAM's PINS= ($(sed -n 's/^PINS=//p' UPSTREAM))"
fi
upstream_value() {
    local value
    value=$(sed -n "s/^$1=//p" "$pin_file" | tail -n 1)
    [[ -n $value ]] || die "$pin_file has no $1= line"
    printf '%s' "$value"
}
base_image=$(upstream_value BASE_IMAGE)
vllm_version=$(upstream_value VLLM_VERSION)

revision=$(git rev-parse HEAD 2>/dev/null) || die "not a git checkout: cannot label the image's revision"
if [[ -n $(git status --porcelain --untracked-files=no 2>/dev/null) ]]; then
    echo "build-image: warning: uncommitted changes; the revision label $revision does not describe them" >&2
fi

tag="vllm-ddtree:${vllm_version}-${revision:0:12}"
if [[ ${1:-} == -t || ${1:-} == --tag ]]; then
    [[ -n ${2:-} ]] || die "$1 needs NAME:TAG"
    tag=$2
    shift 2
fi

labels=(
    --label "org.opencontainers.image.revision=$revision"
    --label "org.opencontainers.image.created=$(date -u +%Y-%m-%dT%H:%M:%SZ)"
)
if source_url=$(git remote get-url origin 2>/dev/null) && [[ $source_url == https://* ]]; then
    labels+=(--label "org.opencontainers.image.source=$source_url")
fi

echo "build-image: building $tag from $base_image (vLLM $vllm_version)" >&2
"$docker" build --file Dockerfile \
    --build-arg "BASE_IMAGE=$base_image" \
    --build-arg "VLLM_VERSION=$vllm_version" \
    "${labels[@]}" --tag "$tag" "$@" .

# The manifest as the image sees it; no GPU or network is needed for this.
info=$("$docker" run --rm --network none --entrypoint python3 "$tag" \
    /opt/vllm-ddtree/deploy/check_install.py --vllm-version "$vllm_version" --print-labels) ||
    die "the built image $tag failed its install check"

info_value() {
    local value
    value=$(sed -n "s/^$1=//p" <<<"$info")
    [[ -n $value ]] || die "the install check printed no $1 (got: $info)"
    printf '%s' "$value"
}
series_sha256=$(info_value series_sha256)
ddtree_version=$(info_value vllm_ddtree_version)
patch_count=$(info_value patch_count)

printf 'FROM %s\n' "$tag" | "$docker" build \
    --label "io.github.vllm-ddtree.series-sha256=$series_sha256" \
    --label "io.github.vllm-ddtree.patch-count=$patch_count" \
    --label "org.opencontainers.image.version=$ddtree_version" \
    --tag "$tag" -

echo "build-image: built $tag (vllm_ddtree $ddtree_version, series $series_sha256, $patch_count patches)"
