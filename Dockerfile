# CUDA-enabled PyTorch image with mlcls installed; default command: mlcls-train.
#   docker build -t mlcls .
#   docker run --gpus all --ipc=host -v /data:/data mlcls \
#       mlcls-train dataset=coco dataset.root=/data/coco loss=twoway
#   docker run --gpus all --ipc=host -v /data:/data mlcls \
#       torchrun --nproc_per_node=4 -m mlcls.train dataset=coco dataset.root=/data/coco
# The base image's torch satisfies pyproject's torch range (tests/test_dockerfile.py checks the tag), and pip
# keeps it: torch and torchvision are pinned to the image's own builds, never replaced by PyPI wheels.
FROM pytorch/pytorch:2.7.1-cuda12.8-cudnn9-runtime

ENV PYTHONDONTWRITEBYTECODE=1 PIP_NO_CACHE_DIR=1
WORKDIR /opt/mlcls
COPY pyproject.toml README.md ./
COPY mlcls ./mlcls
COPY scripts ./scripts
# The Hydra configs ship inside the package (mlcls/configs).
RUN pip list --format=freeze | grep -E '^(torch|torchvision)==' > /tmp/image-torch.txt \
 && pip install --constraint /tmp/image-torch.txt ".[slurm]" && mlcls-train --help > /dev/null

WORKDIR /workspace
CMD ["mlcls-train"]
