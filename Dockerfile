FROM python:3.11-slim

WORKDIR /app
ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1
COPY pyproject.toml README.md ./
COPY server ./server
COPY client ./client
COPY protos ./protos
RUN pip install --no-cache-dir .

RUN useradd --create-home ssmserve
USER ssmserve
WORKDIR /home/ssmserve
# The main job until the gRPC worker lands: the offline demo on the demo model.
CMD ["python", "-m", "client.demo"]
