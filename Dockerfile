# CUDA-enabled PyTorch image with mlcls installed; default command: mlcls-train.
#   docker build -t mlcls .
#   docker run --gpus all --ipc=host -v /data:/data mlcls \
#       mlcls-train dataset=coco dataset.root=/data/coco loss=twoway
#   docker run --gpus all --ipc=host -v /data:/data mlcls \
#       torchrun --nproc_per_node=4 -m mlcls.train dataset=coco dataset.root=/data/coco
FROM pytorch/pytorch:2.5.1-cuda12.4-cudnn9-runtime

ENV PYTHONDONTWRITEBYTECODE=1 PIP_NO_CACHE_DIR=1
WORKDIR /opt/mlcls
COPY pyproject.toml README.md ./
COPY mlcls ./mlcls
COPY scripts ./scripts
# The Hydra configs ship inside the package (mlcls/configs).
RUN pip install ".[slurm]" && mlcls-train --help > /dev/null

WORKDIR /workspace
CMD ["mlcls-train"]
