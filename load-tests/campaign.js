// Campaign: a voucher that never sells out, steady high rate, p99 threshold.
//   k6 run -e ADMIN_TOKEN=… -e RATE=3000 -e DURATION=20s load-tests/campaign.js
import exec from 'k6/execution';
import { check } from 'k6';
import http from 'k6/http';
import { createVoucher, checkLedger, ledgerMatchesClients, reserve, sawCreated, warm, latencyThreshold } from './lib.js';

const RATE = parseInt(__ENV.RATE || '3000', 10);

http.setResponseCallback(http.expectedStatuses(201));

export const options = {
  scenarios: {
    steady: {
      executor: 'constant-arrival-rate',
      rate: RATE,
      timeUnit: '1s',
      duration: __ENV.DURATION || '20s',
      preAllocatedVUs: Math.min(500, RATE),
      maxVUs: 2000,
    },
  },
  thresholds: Object.assign(latencyThreshold(), ledgerMatchesClients(), {
    checks: ['rate==1.0'],
    http_req_failed: ['rate==0'],
  }),
  summaryTrendStats: ['avg', 'p(50)', 'p(90)', 'p(99)', 'max'],
};

export function setup() {
  const code = createVoucher('CAMPAIGN', 1000000000, 1);
  warm(code);
  return { code };
}

export default function (data) {
  const customer = exec.scenario.iterationInTest + 1;
  const res = reserve(customer, data.code, customer, `${data.code}-${customer}`);
  check(res, { 'reserve 201': (r) => r.status === 201 });
  if (res.status === 201) sawCreated(`${data.code}-${customer}`);
}

export function teardown(data) {
  checkLedger(data.code);
}
