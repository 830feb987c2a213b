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
EXPOSE 50051
# The main job: a server on an embedded Redis plus the demo client (see README). To serve:
#   docker run -p 50051:50051 ssmserve ssmserve-server --demo --listen 0.0.0.0:50051
CMD ["python", "-m", "client.demo"]
