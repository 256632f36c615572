# inferlb from its wheel, as a user's `pip install` gets it (the image serves `inferlb serve` and the
# simulated backends of docker-compose.yml). The same commands run outside Docker in CI
# (tests/integration/test_wheel.py): build the wheel, install it in a fresh venv, run it elsewhere.
FROM python:3.11-slim AS wheel
# gcc builds the picker's compiled decoder (ext_proc/_wire.c) into the wheel; the image itself needs none.
RUN apt-get update -qq && apt-get install -y -qq --no-install-recommends gcc libc6-dev && rm -rf /var/lib/apt/lists/*
WORKDIR /src
COPY . .
RUN pip wheel --no-cache-dir --no-deps -w /wheels .

FROM python:3.11-slim
COPY --from=wheel /wheels /wheels
# The k8s extra: deploy/kubernetes runs this image with discovery.kubernetes.
RUN pip install --no-cache-dir "$(ls /wheels/*.whl)[k8s]" && rm -rf /wheels
WORKDIR /var/lib/inferlb
CMD ["inferlb", "--help"]
