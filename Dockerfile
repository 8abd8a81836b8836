# osd image for the serve and trainer services. GPU hosts: build with
#   --build-arg TORCH_SPEC="torch==2.13.0 --index-url https://download.pytorch.org/whl/cu128"
FROM python:3.11-slim
ARG TORCH_SPEC="torch==2.13.0"
RUN apt-get update && apt-get install -y --no-install-recommends curl redis-tools \
    && rm -rf /var/lib/apt/lists/*
WORKDIR /app
COPY pyproject.toml README.md ./
COPY osd ./osd
COPY serving ./serving
COPY trainer ./trainer
COPY launcher ./launcher
COPY configs ./configs
RUN pip install --no-cache-dir ${TORCH_SPEC} && pip install --no-cache-dir ".[serve]"
ENV HF_HOME=/data/hf WANDB_DIR=/data/wandb
EXPOSE 8000
